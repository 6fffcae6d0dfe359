"""Priority scores, global top-k selection, baselines, scoring passes, resume, targets."""

import functools
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cpjax import input_pipeline, prioritization, scoring, selection, sharding, train
from tests.helpers import read_metrics, tiny_config


def _numpy_top_k(scores, ids, k):
  """Reference: sort by score descending, then id ascending; NaN last."""
  key = np.where(np.isnan(scores), -np.inf, scores)
  return ids[np.lexsort((ids, -key))[:k]]


def _numpy_entropy(logits):
  """The seed code's normalised entropy, -sum p log(p + 1e-6) / log K, in float64."""
  z = np.asarray(logits, np.float64)
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  return -(p * np.log(p + 1e-6)).sum(1) / np.log(z.shape[1])


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("n, k", [(1000, 100), (997, 333), (13, 13), (50, 1)])
def test_top_k_matches_numpy_with_ties(num_devices, n, k):
  rng = np.random.default_rng(n + k)
  scores = rng.integers(0, 20, n).astype(np.float32) / 20  # Many exact ties.
  scores[rng.integers(0, n, 3)] = np.nan
  ids = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int32)
  mesh = sharding.create_mesh(jax.devices()[:num_devices])
  got = selection.select_top_k(scores, ids, k, mesh)
  np.testing.assert_array_equal(got, _numpy_top_k(scores, ids, k))


def test_uniform_sorted_takes_every_stride_th_of_the_ranking():
  scores = np.array([0.1, 0.9, 0.5, 0.7, 0.3, 0.8, 0.2], np.float32)
  ids = np.arange(7) * 2
  # Ranking by score: ids 2(0.9) 10(0.8) 6(0.7) 4(0.5) 8(0.3) 12(0.2) 0(0.1); stride 7 // 3 = 2.
  np.testing.assert_array_equal(selection.select_uniform_sorted(scores, ids, 3), [2, 6, 8])


def test_random_baselines_redraw_per_epoch_and_static_stays():
  ids = np.arange(100, 600)
  per_epoch = [selection.random_subset(ids, 50, seed=1, epoch=e) for e in range(3)]
  static = [selection.random_subset(ids, 50, seed=1, epoch=None) for _ in range(3)]
  for subset in per_epoch + static:
    assert len(np.unique(subset)) == 50 and np.isin(subset, ids).all()
  assert not np.array_equal(per_epoch[0], per_epoch[1])
  np.testing.assert_array_equal(per_epoch[1], selection.random_subset(ids, 50, seed=1, epoch=1))
  assert all(np.array_equal(static[0], s) for s in static)


def test_selection_rejects_bad_inputs():
  with pytest.raises(ValueError, match="k=0 must be in"):
    selection.select_top_k(np.zeros(3), np.arange(3), 0)
  with pytest.raises(ValueError, match="strictly increasing"):
    selection.select_top_k(np.zeros(3), np.array([0, 2, 1]), 1)
  assert selection.subset_size(0.1, 0, 45000) == 4500
  assert selection.subset_size(0.1, 7, 45000) == 7


def test_scores_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(64, 7)).astype(np.float32) * 3
  labels = rng.integers(0, 7, 64)
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  top = np.sort(p, axis=1)
  expected = {
      "entropy": -(p * np.log(p + 1e-6)).sum(1) / np.log(7),
      "least_confidence": 1 - p.max(1),
      "margin": top[:, -2] - top[:, -1],
      "loss": -np.log(p[np.arange(64), labels]),
      "el2n": np.sqrt(((p - np.eye(7)[labels]) ** 2).sum(1)),
  }
  assert set(expected) == set(scoring.SCORES)
  for name, fn in scoring.SCORES.items():
    np.testing.assert_allclose(fn(jnp.asarray(logits), jnp.asarray(labels)), expected[name],
                               rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def digits():
  return input_pipeline.get_datasets(tiny_config().dataset)


def test_fresh_pass_scores_every_id_once_and_matches_numpy_entropy(digits, tmp_path):
  config = tiny_config()
  run = train._start(config, str(tmp_path))  # Fresh state on 8 devices.
  split = digits["train"]  # 1,257 examples: batches of 104 do not divide it.

  def id_step(state, batch):
    del state
    return batch["id"].astype(jnp.float32)
  seen = sharding.predict(jax.jit(id_step), run.state, split, run.mesh, 104)
  np.testing.assert_array_equal(seen, split.ids)  # Every id once, in row order.

  score_fn = jax.jit(functools.partial(prioritization.score_step, model=run.model,
                                       config=config, score_fn=scoring.normalized_entropy))
  scores = sharding.predict(score_fn, run.state, split, run.mesh, 104)
  logits = sharding.predict(run.eval_fn, run.state, split, run.mesh, 128)
  np.testing.assert_allclose(scores, _numpy_entropy(logits), rtol=1e-4)


def _restore(workdir, step=None):
  """A checkpoint's state onto one local device, whatever topology saved it."""
  manager = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
  step = step or manager.latest_step()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        manager.item_metadata(step)["state"])
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"]


def _selected(**overrides):
  return tiny_config(**{"num_epochs": 4, "selection.method": "top_k", "selection.fraction": 0.25,
                        "selection.warmup_epochs": 1, "keep_checkpoints": 10, **overrides})


def test_train_pass_buffer_holds_exactly_the_epochs_scores(tmp_path):
  train.train_and_evaluate(_selected(**{"selection.record_scores": True}), str(tmp_path))
  ids = input_pipeline.get_datasets(tiny_config().dataset)["train"].ids
  previous = None
  for epoch in range(4):
    recorded = np.load(tmp_path / prioritization.SCORE_FILE.format(epoch=epoch))
    buffer = np.asarray(_restore(str(tmp_path), epoch + 1)["selection"]["scores"])
    trained = ~np.isnan(recorded[ids])
    assert trained.sum() == (1257 if epoch == 0 else round(0.25 * 1257))
    np.testing.assert_array_equal(buffer[trained], recorded[ids][trained])
    if previous is not None:  # Examples not trained keep their stale scores...
      np.testing.assert_array_equal(buffer[~trained], previous[~trained])
      # ...and the trained ones were the top-k of the buffer before the epoch.
      np.testing.assert_array_equal(np.sort(ids[trained]),
                                    np.sort(_numpy_top_k(previous, ids, trained.sum())))
    previous = buffer
  assert np.isnan(recorded[np.setdiff1d(np.arange(1437), ids)]).all()  # Validation ids.


def test_resume_with_selection_is_exact(tmp_path, monkeypatch):
  config = _selected(**{"selection.method": "top_k"})
  train.train_and_evaluate(config, str(tmp_path / "straight"))

  original = prioritization.Prioritizer.after_epoch

  def crash_at_epoch_2(self, epoch, *args, **kwargs):
    if epoch == 2:
      raise KeyboardInterrupt("simulated preemption")
    return original(self, epoch, *args, **kwargs)
  monkeypatch.setattr(prioritization.Prioritizer, "after_epoch", crash_at_epoch_2)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(config, str(tmp_path / "resumed"))
  monkeypatch.setattr(prioritization.Prioritizer, "after_epoch", original)
  train.train_and_evaluate(config, str(tmp_path / "resumed"))

  def without_timing(workdir):
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")}
            for r in read_metrics(str(workdir))]
  assert without_timing(tmp_path / "resumed") == without_timing(tmp_path / "straight")
  straight, resumed = _restore(str(tmp_path / "straight")), _restore(str(tmp_path / "resumed"))
  for tree in (straight, resumed):
    del tree["selection"]["seconds"]
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_target_of_another_architecture_scores_once(tmp_path):
  target_dir = str(tmp_path / "target")
  train.train_and_evaluate(tiny_config(**{"num_epochs": 1, "model.name": "resnet20"}),
                           target_dir)
  config = _selected(**{"num_epochs": 3, "selection.target_workdir": target_dir,
                        "selection.rescore_every": 0})
  train.train_and_evaluate(config, str(tmp_path / "current"))
  # Independently: the target's eval-mode entropies over the training split.
  target = train._start(prioritization.read_run_config(target_dir), target_dir)
  expected = _numpy_entropy(sharding.predict(target.eval_fn, target.state, target.splits["train"],
                                          target.mesh, 128))
  buffer = np.asarray(_restore(str(tmp_path / "current"))["selection"]["scores"])
  np.testing.assert_allclose(buffer, expected, rtol=1e-4, atol=1e-6)
  records = read_metrics(str(tmp_path / "current"))
  assert records[1]["scoring_seconds"] > 0 and records[2]["scoring_seconds"] < 0.01  # Cached.
  assert records[1]["subset_overlap"] is None and records[2]["subset_overlap"] == 1.0


def test_per_epoch_target_scores_drive_the_same_epoch(tmp_path):
  target_dir = str(tmp_path / "target")
  train.train_and_evaluate(tiny_config(**{"num_epochs": 3, "selection.record_scores": True}),
                           target_dir)
  config = _selected(**{"num_epochs": 3, "selection.target_workdir": target_dir,
                        "selection.target_per_epoch": True, "selection.record_scores": True})
  train.train_and_evaluate(config, str(tmp_path / "current"))
  ids = input_pipeline.get_datasets(tiny_config().dataset)["train"].ids
  for epoch in (1, 2):
    target_scores = np.load(os.path.join(target_dir, f"scores/epoch_{epoch:04d}.npy"))[ids]
    trained = ~np.isnan(np.load(tmp_path / "current" / f"scores/epoch_{epoch:04d}.npy")[ids])
    np.testing.assert_array_equal(np.sort(ids[trained]),
                                  np.sort(_numpy_top_k(target_scores, ids, trained.sum())))


def test_bad_target_fails_before_any_work(tmp_path):
  with pytest.raises(Exception, match="has no checkpoints/ folder"):
    train.train_and_evaluate(_selected(**{"selection.target_workdir": str(tmp_path / "x")}),
                             str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  assert not glob.glob(str(tmp_path / "**" / "*.npy"), recursive=True)


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_select_and_train_like_one(tmp_path):
  """2 processes x 2 CPU devices over jax.distributed on 127.0.0.1 == 1 process x 4."""
  import subprocess
  from tests.helpers import REPO, main_command
  flags = ("--config.num_epochs=3", "--config.selection.method=top_k",
           "--config.selection.fraction=0.25", "--config.selection.warmup_epochs=1",
           "--config.selection.record_scores=True")

  def env(devices):
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  single = subprocess.run(main_command(one, *flags), cwd=REPO, env=env(4), capture_output=True,
                          text=True, timeout=300)
  assert single.returncode == 0, single.stderr[-3000:]
  port = _free_port()
  procs = [subprocess.Popen(
      main_command(two, *flags, f"--coordinator_address=127.0.0.1:{port}",
                   "--num_processes=2", f"--process_id={i}"),
      cwd=REPO, env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=300) for p in procs]
  for proc, (_, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-3000:]
  assert "JAX process 1 / 2" in outputs[1][1]
  ids = input_pipeline.get_datasets(tiny_config().dataset)["train"].ids
  for epoch in range(3):
    a, b = (np.load(os.path.join(d, prioritization.SCORE_FILE.format(epoch=epoch)))[ids]
            for d in (one, two))
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))  # The same ids were trained.
    np.testing.assert_allclose(a, b, atol=1e-4)
  # Cross-process gradient sums add in another order: ~30 SGD steps grow the
  # float32 rounding differences to ~5e-4 in weights of size ~0.1 (measured).
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=2e-3),
               _restore(one)["train"]["params"], _restore(two)["train"]["params"])
