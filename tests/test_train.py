"""Train/eval steps: learning, device-count invariance, faults, resume, end to end."""

import functools
import json
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from cpjax import input_pipeline, losses, models, optim, scoring, sharding, train
from tests.helpers import main_command, read_metrics, run_main, tiny_config, REPO


def _setup(config, devices):
  mesh = sharding.create_mesh(devices)
  spec = input_pipeline.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, spec.num_classes)
  tx = optim.create_optimizer(config.optimizer)
  state = train.create_train_state(jax.random.PRNGKey(0), model, tx, spec.image_shape, mesh)
  step = jax.jit(functools.partial(train.train_step, model=model, tx=tx, config=config,
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scoring.normalized_entropy))
  return mesh, model, state, step


@pytest.fixture(scope="module")
def digits():
  return input_pipeline.get_datasets(tiny_config().dataset)


def test_train_step_lowers_the_loss_on_a_fixed_batch(digits):
  config = tiny_config(**{"dataset.crop_padding": 0})
  mesh, _, state, step = _setup(config, jax.devices())
  batch = sharding.to_global(mesh, input_pipeline.batch_at(digits["train"], np.arange(64)), 64)
  losses_seen = []
  for _ in range(60):
    state, m, _ = step(state, batch, np.float32(0.2), {})
    losses_seen.append(float(m["loss_sum"] / m["count"]))
  assert np.mean(losses_seen[-5:]) < 0.6 * losses_seen[0]
  assert int(state.step) == 60


def test_one_and_eight_devices_give_the_same_loss_and_gradients(digits):
  config = tiny_config()
  rows = np.arange(64)
  results = []
  for devices in (jax.devices()[:1], jax.devices()[:8]):
    mesh, model, state, _ = _setup(config, devices)
    batch = sharding.to_global(mesh, input_pipeline.batch_at(digits["train"], rows), 64)
    assert batch["image"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert len(batch["image"].sharding.device_set) == len(devices)

    def loss_of(params, state=state, batch=batch, model=model):
      images = batch["image"].astype(jnp.float32) / 255.0
      (logits, _), _ = model.apply({"params": params, "batch_stats": state.batch_stats},
                                   images, train=True, mutable=["batch_stats"])
      return jnp.mean(losses.cross_entropy(logits, batch["label"]))
    results.append(jax.device_get(jax.jit(jax.value_and_grad(loss_of))(state.params)))
  (loss1, grads1), (loss8, grads8) = results
  np.testing.assert_allclose(loss1, loss8, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads1, grads8)


def test_full_train_step_matches_across_device_counts(digits):
  """The whole step (augmentation, BatchNorm, optimizer) is device-count invariant."""
  config = tiny_config()
  params = []
  for devices in (jax.devices()[:1], jax.devices()[:8]):
    mesh, _, state, step = _setup(config, devices)
    for i in range(3):
      rows = np.arange(64 * i, 64 * (i + 1))
      batch = sharding.to_global(mesh, input_pipeline.batch_at(digits["train"], rows), 64)
      state, _, _ = step(state, batch, np.float32(0.05), {})
    params.append(jax.device_get(state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *params)


def test_learning_rate_schedules_by_hand():
  config = tiny_config(**{"optimizer.learning_rate": 0.1}).optimizer
  assert optim.learning_rate_at(config, 0, 200) == pytest.approx(0.1)
  assert optim.learning_rate_at(config, 100, 200) == pytest.approx(0.05)
  assert optim.learning_rate_at(config, 199, 200) == pytest.approx(0.1 * (1 + np.cos(np.pi * 199 / 200)) / 2)
  config.schedule = "multistep"
  got = [optim.learning_rate_at(config, e, 350) for e in (0, 149, 150, 249, 250)]
  np.testing.assert_allclose(got, [0.1, 0.1, 0.01, 0.01, 0.001])


def test_optimizer_is_pytorch_sgd_with_coupled_weight_decay_and_clipping():
  config = tiny_config(**{"optimizer.weight_decay": 0.01, "optimizer.grad_clip_norm": 1.0}).optimizer
  tx = optim.create_optimizer(config)
  theta, buf = np.array([1.0, -2.0]), np.zeros(2)
  params = jnp.array(theta, jnp.float32)
  state = tx.init(params)
  for raw in ([3.0, 4.0], [0.1, 0.2]):  # The first gradient is clipped (norm 5 -> 1).
    g = np.array(raw) * min(1.0, 1.0 / np.linalg.norm(raw))
    buf = 0.9 * buf + g + 0.01 * theta  # torch.optim.SGD, dampening 0.
    theta = theta - 0.05 * buf
    state.hyperparams["learning_rate"] = jnp.float32(0.05)
    updates, state = tx.update(jnp.array(raw, jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params, theta, rtol=1e-5)


def test_non_finite_loss_stops_with_epoch_and_step_and_keeps_checkpoint(tmp_path, monkeypatch):
  real = optim.learning_rate_at
  monkeypatch.setattr(optim, "learning_rate_at",  # Epoch 1 diverges.
                      lambda c, e, n: 1e30 if e == 1 else real(c, e, n))
  config = tiny_config(**{"num_epochs": 3, "optimizer.weight_decay": 0.0})
  with pytest.raises(train.NonFiniteLossError, match=r"at epoch 1, step \d+ of the epoch"):
    train.train_and_evaluate(config, str(tmp_path))
  assert [r["epoch"] for r in read_metrics(str(tmp_path))] == [0]
  assert ocp.CheckpointManager(str(tmp_path / "checkpoints")).all_steps() == [1]


def test_unwritable_workdir_fails_early(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(PermissionError, match="not a writable directory"):
    train.train_and_evaluate(tiny_config(), str(blocker / "workdir"))


def test_restoring_into_other_shapes_names_the_mismatch(tmp_path):
  train.train_and_evaluate(tiny_config(**{"num_epochs": 1}), str(tmp_path))
  with pytest.raises(Exception, match=r"params.Conv_0.kernel: checkpoint \(3, 3, 1, 8\) vs "
                                      r"config \(3, 3, 1, 16\)"):
    train.train_and_evaluate(tiny_config(**{"num_epochs": 2, "model.name": "resnet20"}),
                             str(tmp_path))


def _final_params(workdir):
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))
  state = restored["state"]
  del state["selection"]["seconds"]  # Wall-clock totals differ between any two runs.
  return state


def _without_timing(records):
  return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in records]


def test_sigkill_and_rerun_reproduces_the_uninterrupted_run(tmp_path):
  flags = ("--config.num_epochs=6", "--config.model.name=resnet20", "--config.batch_size=128")
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  assert run_main(straight, *flags).returncode == 0
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(main_command(killed, *flags), cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while not os.path.isdir(os.path.join(killed, "checkpoints", "2")) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL  # Killed midway, not finished.
  assert not os.path.isdir(os.path.join(killed, "checkpoints", "6"))
  resumed = run_main(killed, *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  assert _without_timing(read_metrics(killed)) == _without_timing(read_metrics(straight))
  jax.tree.map(np.testing.assert_array_equal, _final_params(killed), _final_params(straight))


def test_main_end_to_end(tmp_path):
  result = run_main(str(tmp_path), "--config.num_epochs=2")
  assert result.returncode == 0, result.stderr[-3000:]
  records = read_metrics(str(tmp_path))
  assert [r["epoch"] for r in records] == [0, 1]
  for key in ("train_loss", "train_accuracy", "val_accuracy", "val_nll", "test_accuracy",
              "test_nll", "epoch_seconds"):
    assert all(np.isfinite(r[key]) for r in records), key
  assert all(0 <= r[k] <= 1 for r in records for k in ("val_accuracy", "test_accuracy"))
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  for key in ("ece", "adaptive_ece", "classwise_ece", "mce"):
    assert all(0 <= r[f"test_{key}"] <= 1 for r in records), key
  report = _check_report(tmp_path / "report")
  # The report's before-TS test numbers are the last epoch's, from the same logits.
  for key in ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "mce"):
    assert report["metrics"]["test"]["before_ts"][key] == pytest.approx(records[-1][f"test_{key}"])

  # Evaluate-only rewrites the same report from the latest checkpoint, without training.
  for name in os.listdir(tmp_path / "report"):
    os.remove(tmp_path / "report" / name)
  evaluated = run_main(str(tmp_path), "--config.num_epochs=2", "--mode=evaluate")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  again = _check_report(tmp_path / "report")
  assert again["metrics"] == report["metrics"] and again["intervals"] == report["intervals"]
  assert len(read_metrics(str(tmp_path))) == 2  # No epoch was trained.


def _check_report(report_dir):
  """The report's files exist, the PNGs decode to non-blank images; returns results.json."""
  from PIL import Image
  for name in ("reliability_before_ts.png", "reliability_after_ts.png",
               "confidence_histogram.png"):
    with Image.open(report_dir / name) as image:
      pixels = np.asarray(image.convert("L"))
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 10, name
  assert "Temperature (grid_ece" in (report_dir / "results.md").read_text()
  with open(report_dir / "results.json") as f:
    report = json.load(f)
  fit = report["temperature"]
  assert 0.1 <= fit["temperature"] <= 10.0
  for tag in ("before_ts", "after_ts"):
    assert report["metrics"]["test"][tag]["accuracy"] == report["metrics"]["test"]["before_ts"]["accuracy"]
    for name, interval in report["intervals"][tag].items():
      assert interval["low"] <= interval["high"] and interval["num_resamples"] == 100, name
    assert set(report["ood"][tag]) == {"entropy", "max_softmax", "max_logit", "energy"}
  assert sum(report["reliability"]["before_ts"]["count"]) == 360  # Every test image binned.
  return report


def test_main_rejects_a_bad_override_before_any_work(tmp_path):
  result = run_main(str(tmp_path / "wd"), "--config.loss.name=bogus", timeout=60)
  assert result.returncode != 0
  assert "config.loss.name: got 'bogus'; valid choices: brier, ce_dece" in result.stderr
  assert not (tmp_path / "wd" / "checkpoints").exists()
