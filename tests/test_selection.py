"""Priority scores, global top-k selection, baselines, the score buffer, resume, targets.

The sharded scoring pass itself (`steps.predict` of `steps.score_step`) is tested in
test_steps.py. The selected run that several tests read is `selected_run` (tests/trained_runs.py).
"""

import glob
import math

import jax
import numpy as np
import pytest
import scipy.stats

from cpjax import models, run_state, steps
from cpjax.data import augment, specs
from cpjax.runtime import preemption, sharding
from cpjax.selection import (
  bookkeeping,
  policies,
  score_files,
  score_sources,
  scores,
  selector,
  subsets,
)
from cpjax.training import train
from tests import helpers
from tests.helpers import read_metrics

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.


def _numpy_top_k(scores, ids, k):
  """Reference: sort by score descending, then id ascending; NaN last."""
  key = np.where(np.isnan(scores), -np.inf, scores)
  return ids[np.lexsort((ids, -key))[:k]]


def _numpy_cross_entropy(logits, labels):
  """-log softmax(z)_y in float64, with a max-shifted log-sum-exp."""
  z = np.asarray(logits, np.float64)
  shifted = z - z.max(1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
  return -log_probs[np.arange(len(z)), labels]


def _target_logits(workdir, split):
  """Eval-mode logits of `split` under a run's latest checkpoint, with its saved model, by
  model.apply on all of it at once (not through cpjax's steps, mesh or batches)."""
  config = score_sources.read_run_config(workdir)
  state = helpers.restore_checkpoint(workdir)["train"]
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes)
  logits, _ = jax.jit(lambda s, x: model.apply(  # (logits, features)
      {"params": s["params"], "batch_stats": s["batch_stats"]},
      augment.normalize(x, data.mean, data.std), train=False))(state, split.images)
  return logits


def _numpy_entropy(logits):
  """Tata et al. 2022's normalised entropy, -sum p log(p + 1e-6) / log K, in float64."""
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
  got = subsets.select_top_k(scores, ids, k, mesh)
  np.testing.assert_array_equal(got, _numpy_top_k(scores, ids, k))


def test_uniform_sorted_takes_every_stride_th_of_the_ranking():
  scores = np.array([0.1, 0.9, 0.5, 0.7, 0.3, 0.8, 0.2], np.float32)
  ids = np.arange(7) * 2
  # Ranking by score: ids 2(0.9) 10(0.8) 6(0.7) 4(0.5) 8(0.3) 12(0.2) 0(0.1); stride 7 // 3 = 2.
  np.testing.assert_array_equal(subsets.select_uniform_sorted(scores, ids, 3), [2, 6, 8])


def test_random_baselines_redraw_per_epoch_and_static_stays():
  ids = np.arange(100, 600)
  per_epoch = [subsets.random_subset(ids, 50, seed=1, epoch=e) for e in range(3)]
  static = [subsets.random_subset(ids, 50, seed=1, epoch=None) for _ in range(3)]
  for subset in per_epoch + static:
    assert len(np.unique(subset)) == 50 and np.isin(subset, ids).all()
  assert not np.array_equal(per_epoch[0], per_epoch[1])
  np.testing.assert_array_equal(per_epoch[1], subsets.random_subset(ids, 50, seed=1, epoch=1))
  assert all(np.array_equal(static[0], s) for s in static)


def test_selection_rejects_bad_inputs():
  with pytest.raises(ValueError, match="k=0 must be in"):
    subsets.select_top_k(np.zeros(3), np.arange(3), 0)
  with pytest.raises(ValueError, match="strictly increasing"):
    subsets.select_top_k(np.zeros(3), np.array([0, 2, 1]), 1)
  assert policies.subset_size(0.1, 0, 45000) == 4500
  assert policies.subset_size(0.1, 7, 45000) == 7


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
  assert set(expected) | {"reducible_loss"} == set(scores.SCORES.names())
  # All five in one jitted program (op by op, every operation would compile on its own).
  got = jax.jit(lambda z, y: {name: scores.forward_score(name)(z, y) for name in expected})(
      logits, labels)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_train_pass_buffer_holds_exactly_the_epochs_scores(selected_run, digits):
  workdir, ids = selected_run.workdir, digits["train"].ids
  k = policies.subset_size(selected_run.config.selection.fraction, 0, len(ids))
  checkpoints = helpers.checkpoint_steps(workdir)  # One per epoch, named by global step.
  assert len(checkpoints) == 3
  previous = None
  for epoch, step in enumerate(checkpoints):
    recorded = np.load(score_files.score_path(workdir, epoch))
    buffer = np.asarray(helpers.restore_checkpoint(workdir, step)["selection"]["scores"])
    trained = ~np.isnan(recorded[ids])
    assert trained.sum() == (1257 if epoch == 0 else k)
    np.testing.assert_array_equal(buffer[trained], recorded[ids][trained])
    if previous is not None:  # Examples not trained keep their stale scores...
      np.testing.assert_array_equal(buffer[~trained], previous[~trained])
      # ...and the trained ones were the top-k of the buffer before the epoch.
      np.testing.assert_array_equal(np.sort(ids[trained]),
                                    np.sort(_numpy_top_k(previous, ids, trained.sum())))
    previous = buffer
  assert np.isnan(recorded[np.setdiff1d(np.arange(1437), ids)]).all()  # Validation ids.


def test_resume_with_selection_is_exact(selected_run, tmp_path, monkeypatch):
  """A run stopped in epoch 2 and rerun ends exactly as the uninterrupted `selected_run`."""
  workdir = str(tmp_path / "resumed")
  original = selector.Selector.after_epoch

  def crash_at_epoch_2(self, epoch, *args, **kwargs):
    if epoch == 2:
      raise KeyboardInterrupt("simulated preemption")
    return original(self, epoch, *args, **kwargs)
  monkeypatch.setattr(selector.Selector, "after_epoch", crash_at_epoch_2)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(helpers.selected_config(), workdir)
  monkeypatch.setattr(selector.Selector, "after_epoch", original)
  train.train_and_evaluate(helpers.selected_config(), workdir)

  assert (helpers.without_timing(read_metrics(workdir))
          == helpers.without_timing(read_metrics(selected_run.workdir)))
  straight = helpers.restore_checkpoint(selected_run.workdir)
  resumed = helpers.restore_checkpoint(workdir)
  for tree in (straight, resumed):
    del tree["selection"]["seconds"]
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def _count_training_passes(monkeypatch, split) -> list[int]:
  """The batch sizes of the `steps.predict` passes over the training split, as they happen
  (evaluation predicts val/test, which are smaller)."""
  passes = []
  real_predict = steps.predict

  def counted_predict(fn, state, data, mesh, batch_size):
    if len(data) == len(split):
      passes.append(batch_size)
    return real_predict(fn, state, data, mesh, batch_size)
  monkeypatch.setattr(steps, "predict", counted_predict)
  return passes


def test_target_of_another_architecture_scores_once(other_model_run, digits, tmp_path, monkeypatch):
  assert score_sources.read_run_config(other_model_run.workdir).model.name == "small_cnn"
  _check_target_scoring(other_model_run.workdir, digits, tmp_path, monkeypatch)


def test_a_gamma_net_run_serves_as_the_calibrated_target(meta_run, digits, tmp_path, monkeypatch):
  """An FL_gamma run held out its meta-validation rows; the selecting run (cross-entropy, no
  carve-out) trains on them too, which a target may: only the validation split must match."""
  target = score_sources.read_run_config(meta_run.workdir)
  assert target.loss.name == "flgamma_dece" and target.dataset.meta_val_size == 128
  _check_target_scoring(meta_run.workdir, digits, tmp_path, monkeypatch)


def _check_target_scoring(target_workdir, digits, tmp_path, monkeypatch):
  """A selected run scoring with `target_workdir`'s model: one pass, the target's entropies,
  and the scorer's ECE on the subset, all against NumPy."""
  split = digits["train"]
  passes = _count_training_passes(monkeypatch, split)
  config = helpers.selected_config(**{
      "selection.scoring": "target", "selection.target_workdir": target_workdir,
      "selection.rescore_every": 0, "selection.record_scores": False})
  workdir = str(tmp_path / "current")
  train.train_and_evaluate(config, workdir)
  assert passes == [config.selection.score_batch_size]  # Epoch 1 scored; epoch 2 reused it.

  # Independently: the target's eval-mode entropies over the training split.
  logits = _target_logits(target_workdir, split)
  buffer = np.asarray(helpers.restore_checkpoint(workdir)["selection"]["scores"])
  np.testing.assert_allclose(buffer, _numpy_entropy(logits), rtol=1e-4, atol=1e-6)
  records = read_metrics(workdir)
  assert records[1]["subset_overlap"] is None and records[2]["subset_overlap"] == 1.0
  # The scorer's own ECE on the subset (both epochs: one pass, the same subset), from the
  # target's softmax on those rows, 15 right-closed bins summed in a loop.
  subset = np.flatnonzero(np.asarray(helpers.restore_checkpoint(workdir)["selection"]["subset"]))
  logits = np.asarray(logits, np.float32)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  confidence, correct = probs.max(1)[subset], probs.argmax(1)[subset] == split.labels[subset]
  expected = 0.0
  for low, high in zip(np.arange(15) / 15, np.arange(1, 16) / 15):
    inside = (confidence > low) & (confidence <= high)
    if inside.any():
      expected += inside.mean() * abs(correct[inside].mean() - confidence[inside].mean())
  for epoch in (1, 2):
    assert records[epoch]["scorer_ece"] == pytest.approx(expected, abs=1e-5)


def test_reducible_loss_by_hand():
  train_loss = np.array([2.0, 2.0, 0.1, 0.1], np.float32)  # Not yet learnt x2, learnt x2.
  irreducible = np.array([0.2, 1.9, 0.05, 2.0], np.float32)  # Learnable, noisy, twice.
  np.testing.assert_allclose(scores.reducible_loss(train_loss, irreducible),
                             [1.8, 0.1, 0.05, -1.9], rtol=1e-6)
  # Only the learnable, not yet learnt example ranks above the others.
  assert subsets.select_top_k(scores.reducible_loss(train_loss, irreducible),
                               np.arange(4), 1).tolist() == [0]
  # The current model's passes compute its plain cross-entropy.
  assert scores.forward_score("reducible_loss") is scores.loss
  assert scores.forward_score("entropy") is scores.normalized_entropy


def test_reducible_loss_ranks_the_train_pass_losses_less_the_targets(other_model_run, digits,
                                                                      tmp_path, monkeypatch):
  """score='reducible_loss' with a small_cnn target: one pass of the target computes every
  training row's cross-entropy (checkpointed), and each selected epoch trains the top-k of
  the checkpointed train-pass losses less those."""
  split, ids = digits["train"], digits["train"].ids
  passes = _count_training_passes(monkeypatch, split)
  config = helpers.selected_config(**{"selection.score": "reducible_loss",
                                      "selection.target_workdir": other_model_run.workdir})
  workdir = str(tmp_path / "rho")
  train.train_and_evaluate(config, workdir)
  assert passes == [config.selection.score_batch_size]  # Once, at epoch 1; train_pass scoring.

  # Independently: the target's cross-entropy of each training row, by NumPy from its logits.
  irreducible = _numpy_cross_entropy(_target_logits(other_model_run.workdir, split), split.labels)
  checkpoints = helpers.checkpoint_steps(workdir)  # One per epoch, named by global step.
  saved = helpers.restore_checkpoint(workdir)["selection"]
  np.testing.assert_allclose(saved["irreducible"], irreducible, rtol=1e-4, atol=1e-5)
  assert int(saved["irreducible_step"]) == helpers.checkpoint_steps(other_model_run.workdir)[-1]
  records = read_metrics(workdir)
  for epoch in (1, 2):
    raw = np.asarray(helpers.restore_checkpoint(workdir, checkpoints[epoch - 1])
                     ["selection"]["scores"])  # The train-pass losses before the epoch.
    # The checkpointed float32 irreducible losses (equal to NumPy's above), so that the
    # ranking is exact: NumPy's float64 ones could swap two near-tied rows at the k-th place.
    reducible = raw - np.asarray(saved["irreducible"])
    recorded = np.load(score_files.score_path(workdir, epoch))[ids]
    trained = ~np.isnan(recorded)
    np.testing.assert_array_equal(ids[trained], np.sort(_numpy_top_k(reducible, ids, 628)))
    # 628 = round(0.5 * 1257): selected_config's fraction.
    assert records[epoch]["score_mean_selected"] == pytest.approx(reducible[trained].mean())
    assert records[epoch]["irreducible_loss_mean_all"] == pytest.approx(irreducible.mean())
    assert records[epoch]["irreducible_loss_mean_selected"] == pytest.approx(
        irreducible[trained].mean())
  # The buffer keeps the raw train-pass losses (the loss score of the same forward pass).
  after = np.asarray(saved["scores"])
  np.testing.assert_array_equal(after[trained], recorded[trained])


def test_reducible_loss_of_the_target_itself_is_zero_and_its_pass_runs_once(other_model_run,
                                                                           digits, monkeypatch):
  """scoring='fresh' with the target's own model and checkpoint as the current model: the
  fresh pass and the target's pass compute the same losses, so every reducible loss is 0;
  a later epoch rescores (rescore_every=1) but never reruns the target's pass."""
  config = helpers.selected_config(**{
      "model.name": "small_cnn", "selection.scoring": "fresh",
      "selection.score": "reducible_loss", "selection.target_workdir": other_model_run.workdir})
  mesh = sharding.create_mesh()
  current = score_sources.Target(other_model_run.workdir,
                           run_state.abstract(other_model_run.config, mesh,
                                              bookkeeping.initial_state_of(
                                                  other_model_run.config.dataset,
                                                  other_model_run.config.selection))).restore()
  source = score_sources.create_source(config.selection, digits["train"], mesh,
                                 model_name=config.model.name, dataset=config.dataset,
                                 xla_cpu_options=config.xla_cpu_options)
  state = source.refresh(1, current, bookkeeping.initial_state_of(config.dataset, config.selection))
  np.testing.assert_array_equal(state["scores"], state["irreducible"])
  assert int(state["scored_epoch"]) == 1
  assert int(state["irreducible_step"]) == helpers.checkpoint_steps(other_model_run.workdir)[-1]
  passes = []
  real_predict = steps.predict
  monkeypatch.setattr(steps, "predict", lambda *args: passes.append(1) or real_predict(*args))
  again = source.refresh(2, current, state)
  assert len(passes) == 1 and int(again["scored_epoch"]) == 2  # The fresh pass only.
  assert again["irreducible"] is state["irreducible"]


def test_recorded_target_scores_drive_the_same_epoch(main_run, digits, tmp_path):
  """scoring='target_recorded': epoch e trains the top-k of the target's epoch-e scores."""
  config = helpers.selected_config(**{"selection.scoring": "target_recorded",
                                      "selection.target_workdir": main_run.workdir})
  workdir = str(tmp_path / "current")
  train.train_and_evaluate(config, workdir)
  ids = digits["train"].ids
  for epoch in (1, 2):
    target_scores = np.load(score_files.score_path(main_run.workdir, epoch))[ids]
    assert not np.isnan(target_scores).any()  # The target trained on every example.
    trained = ~np.isnan(np.load(score_files.score_path(workdir, epoch))[ids])
    np.testing.assert_array_equal(np.sort(ids[trained]),
                                  np.sort(_numpy_top_k(target_scores, ids, trained.sum())))


def test_bad_target_fails_before_any_work(tmp_path):
  config = helpers.selected_config(**{"selection.scoring": "target",
                                      "selection.target_workdir": str(tmp_path / "x")})
  with pytest.raises(Exception, match="has no checkpoints/ folder"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  assert not glob.glob(str(tmp_path / "**" / "*.npy"), recursive=True)


# configs/test.py, 4 epochs of InfoBatch: epoch 0 on all data (warm-up), epochs 1 and 2 pruned,
# epoch 3 on all data again (the last anneal_fraction = 1/4 of the epochs).
INFOBATCH = {"num_epochs": 4, "selection.method": "infobatch", "selection.score": "loss",
             "selection.warmup_epochs": 1, "selection.anneal_fraction": 0.25,
             "selection.record_scores": True, "keep_checkpoints": 10}


@pytest.fixture(scope="module")
def infobatch_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("infobatch"))
  train.train_and_evaluate(helpers.tiny_config(**INFOBATCH), workdir)
  return workdir


def test_infobatch_trains_the_policys_rows_then_all_data(infobatch_run, digits):
  """Each pruned epoch trains exactly select_infobatch of the checkpointed score buffer (the
  loss of each example's last train pass), in ceil(kept / 64) steps; metrics.jsonl records the
  sizes; the annealing epoch trains everything."""
  ids, records = digits["train"].ids, read_metrics(infobatch_run)
  checkpoints = helpers.checkpoint_steps(infobatch_run)  # One per epoch, named by global step.
  sizes = [r["selected_k"] for r in records]
  assert sizes[0] == sizes[3] == 1257 and max(sizes[1:3]) < 1257
  assert np.diff([0, *checkpoints]).tolist() == [-(-k // 64) for k in sizes]
  assert "kept_count" not in records[0]  # The warm-up prunes nothing and records no pruning.
  for epoch in (1, 2, 3):
    assert records[epoch]["kept_count"] == sizes[epoch]
    assert records[epoch]["pruned_share"] == pytest.approx(1 - sizes[epoch] / 1257)
    buffer = helpers.restore_checkpoint(infobatch_run, checkpoints[epoch - 1])["selection"]
    want, _ = subsets.select_infobatch(np.asarray(buffer["scores"]), ids, 0, epoch, 0.5, 3)
    trained = ~np.isnan(np.load(score_files.score_path(infobatch_run, epoch))[ids])
    np.testing.assert_array_equal(ids[trained], want)
  assert records[3]["pruned_share"] == 0.0


@pytest.mark.slow
def test_infobatch_resumes_mid_epoch_exactly(infobatch_run, tmp_path, monkeypatch):
  """A stop 3 steps into pruned epoch 2, then a rerun: the same rows, weights and number of
  steps, so the metrics and the final state are the uninterrupted run's, bit for bit."""
  workdir = str(tmp_path / "resumed")
  stop = helpers.checkpoint_steps(infobatch_run)[1] + 3
  monkeypatch.setattr(preemption.PreemptionGuard, "should_stop", lambda self, step: step == stop)
  with pytest.raises(preemption.Preempted):
    train.train_and_evaluate(helpers.tiny_config(**INFOBATCH), workdir)
  assert helpers.checkpoint_steps(workdir)[-1] == stop
  monkeypatch.undo()
  train.train_and_evaluate(helpers.tiny_config(**INFOBATCH), workdir)
  assert (helpers.without_timing(read_metrics(workdir))
          == helpers.without_timing(read_metrics(infobatch_run)))
  assert helpers.checkpoint_steps(workdir)[-1] == helpers.checkpoint_steps(infobatch_run)[-1]
  straight, resumed = (helpers.restore_checkpoint(w) for w in (infobatch_run, workdir))
  for tree in (straight, resumed):
    del tree["selection"]["seconds"]
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_subset_diagnostics_by_hand():
  """Six rows, classes [0, 0, 0, 0, 1, 1]; subsets {0, 1} then {1, 4}."""
  labels = np.array([0, 0, 0, 0, 1, 1])
  state = bookkeeping.initial_state(6)
  state, first = bookkeeping.subset_record(state, np.array([0, 1]), labels, 2)
  # Only class 0 (share 2/3 of all rows): KL = 1 * log(1 / (2/3)).
  assert first["subset_class_kl"] == pytest.approx(np.log(1.5))
  assert first["never_selected_share"] == pytest.approx(4 / 6)
  state, second = bookkeeping.subset_record(state, np.array([1, 4]), labels, 2)
  # Half and half against 2/3 and 1/3.
  assert second["subset_class_kl"] == pytest.approx(0.5 * np.log(0.75) + 0.5 * np.log(1.5))
  assert second["never_selected_share"] == pytest.approx(3 / 6)
  assert second["subset_overlap"] == 0.5
  np.testing.assert_array_equal(state["times_selected"], [1, 2, 0, 0, 1, 0])


def test_selected_run_diagnostics_match_its_score_files(selected_run, digits):
  """KL against scipy.stats.entropy and the never-selected share from the recorded scores
  (NaN = not trained that epoch), not from the selection state."""
  ids, labels = digits["train"].ids, digits["train"].labels
  records = read_metrics(selected_run.workdir)
  ever = np.zeros(len(ids), bool)
  for epoch in (1, 2):  # The selected epochs (one warm-up epoch).
    trained = ~np.isnan(np.load(score_files.score_path(selected_run.workdir, epoch))[ids])
    ever |= trained
    subset = np.bincount(labels[trained], minlength=10)
    assert records[epoch]["subset_class_kl"] == pytest.approx(
        scipy.stats.entropy(subset, np.bincount(labels, minlength=10)), rel=1e-6, abs=1e-9)
    assert records[epoch]["never_selected_share"] == pytest.approx(1 - ever.mean())
  assert "never_selected_share" not in records[0]  # Warm-up: nothing selected.


# configs/test.py, 4 epochs of top-k with a rising budget and a final full-data epoch: epoch 0
# on all 1,257 rows (warm-up), epochs 1 and 2 selected with the kept fraction moving from 0.2
# to 0.6, epoch 3 on all rows again (final_full_epochs = 1).
SCHEDULED = {"num_epochs": 4, "selection.method": "top_k", "selection.fraction": 0.2,
             "selection.fraction_end": 0.6, "selection.final_full_epochs": 1,
             "selection.warmup_epochs": 1, "selection.record_scores": True,
             "keep_checkpoints": 10}


@pytest.mark.slow
def test_budget_schedule_and_final_full_epochs_train_the_planned_rows(digits, tmp_path):
  """Epoch sizes by hand: round(0.2 * 1257) = 251 and round(0.6 * 1257) = 754 between two
  full epochs; each selected epoch trains the 251 / 754 highest entropies of the buffer it
  started from (NumPy's sort as the reference), in ceil(k / 64) steps."""
  workdir = str(tmp_path / "scheduled")
  train.train_and_evaluate(helpers.tiny_config(**SCHEDULED), workdir)
  ids, records = digits["train"].ids, read_metrics(workdir)
  sizes = [r["selected_k"] for r in records]
  assert sizes == [1257, 251, 754, 1257]
  checkpoints = helpers.checkpoint_steps(workdir)
  assert np.diff([0, *checkpoints]).tolist() == [20, 4, 12, 20]
  for epoch in (1, 2):
    buffer = helpers.restore_checkpoint(workdir, checkpoints[epoch - 1])["selection"]
    want = np.sort(_numpy_top_k(np.asarray(buffer["scores"]), ids, sizes[epoch]))
    trained = ~np.isnan(np.load(score_files.score_path(workdir, epoch))[ids])
    np.testing.assert_array_equal(ids[trained], want)
  assert "subset_class_kl" not in records[3]  # The final epoch is not a selected one.


def test_fraction_at_by_hand():
  # Selected epochs 2 .. 10 of a schedule from 0.1 to 0.5: +0.05 per epoch.
  assert [policies.fraction_at(0.1, 0.5, e, 2, 10) for e in (2, 6, 10)] == pytest.approx(
      [0.1, 0.3, 0.5])
  assert policies.fraction_at(0.3, -1.0, 7, 2, 10) == 0.3  # Off: the constant fraction.
  assert policies.fraction_at(0.3, 0.9, 4, 4, 4) == 0.3  # One selected epoch: its start.


@pytest.mark.slow  # A whole (tiny) training run.
def test_importance_trains_the_policys_rows_with_its_weights(tmp_path, digits, monkeypatch):
  """configs/test.py, 3 epochs of importance sampling (30 % in expectation, mix 0.3, el2n):
  each selected epoch trains exactly select_importance of the checkpointed score buffer, in
  ceil(drawn / 64) steps, and the rows' loss weights that go to the train reader are the
  policy's normalised weights (mean 1 over the drawn rows), 1 on the rows not drawn."""
  row_weights = []
  def spy(rows, weights, num_rows):
    out = train_row_weights(rows, weights, num_rows)
    row_weights.append((rows, weights, out))
    return out
  train_row_weights = train._row_weights  # pylint: disable=protected-access
  monkeypatch.setattr(train, "_row_weights", spy)
  config = helpers.tiny_config(**{
      "num_epochs": 3, "selection.method": "importance", "selection.fraction": 0.3,
      "selection.mix": 0.3, "selection.score": "el2n", "selection.warmup_epochs": 1,
      "selection.record_scores": True, "keep_checkpoints": 10})
  workdir = str(tmp_path)
  train.train_and_evaluate(config, workdir)
  ids, records = digits["train"].ids, read_metrics(workdir)
  checkpoints = helpers.checkpoint_steps(workdir)
  sizes = [r["selected_k"] for r in records]
  assert sizes[0] == 1257 and np.diff([0, *checkpoints]).tolist() == [-(-k // 64) for k in sizes]
  np.testing.assert_array_equal(row_weights[0][2], np.ones(1257, np.float32))  # Warm-up.
  for epoch in (1, 2):
    buffer = helpers.restore_checkpoint(workdir, checkpoints[epoch - 1])["selection"]
    want, weights = subsets.select_importance(np.asarray(buffer["scores"]), ids, 377, 0, epoch,
                                              0.3, 10.0)
    trained = ~np.isnan(np.load(score_files.score_path(workdir, epoch))[ids])
    np.testing.assert_array_equal(ids[trained], want)
    assert abs(len(want) - 377) < 5 * math.sqrt(377) and records[epoch]["kept_count"] == len(want)
    rows, got, per_row = row_weights[epoch]
    np.testing.assert_array_equal(ids[rows], want)
    np.testing.assert_array_equal(got, weights)
    np.testing.assert_array_equal(per_row[rows], weights)
    assert np.all(np.delete(per_row, rows) == 1.0)
    assert weights.mean() == pytest.approx(1.0, rel=1e-5) and len(set(weights.tolist())) > 1
